"""One file per model family; each registers itself (toolkit.models.family.register)."""
