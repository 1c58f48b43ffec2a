"""The typed config tree, a leaf (imports only itself): sections, parsing, bounds, --help, torchtitan 2025's keys."""
