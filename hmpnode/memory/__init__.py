"""Agent memory kept as HMP containers: the diary_entry journal (hmpnode.memory.journal)."""
