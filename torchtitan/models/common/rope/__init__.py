"""RoPE variants the families share (YaRN)."""
