"""The mesh layer, sans-IO parts first: discovery records (announce), propagation
scope (scope) and the relay chain (relay), profile sections 10-12."""
