"""Data augmentation with lineage: the ``augment`` stage and its operators."""
