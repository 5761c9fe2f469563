"""hmpnode: the mesh node daemon of the HyperCortex Mesh Protocol (HMP v5).

The protocol logic lives in sans-IO packages (`hmpnode.container`,
`hmpnode.identity`); the daemon, storage and network wrap them.
"""

__version__ = "0.1.0"
