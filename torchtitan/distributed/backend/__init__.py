"""The device, the process-group backend and torch-version seams (c10d, DTensor helpers)."""
