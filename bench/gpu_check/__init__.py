"""The one-command GPU check (``python -m bench.gpu_check``; __main__.py says what it runs)."""
