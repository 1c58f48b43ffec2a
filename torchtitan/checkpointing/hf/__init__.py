"""Hugging Face folders: their files, the conversions in and out, a run's start from one and export to one."""
