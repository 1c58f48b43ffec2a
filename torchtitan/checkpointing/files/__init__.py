"""Where checkpoint bytes live: storage (a folder or an fsspec URL), step folders, markers, integrity, the format's version."""
