"""The group's core, free of I/O: the engine's state table and agreement rules
(:mod:`.engine`), views and the status record (:mod:`.view`)."""
