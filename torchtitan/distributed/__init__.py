"""Parallelisms as transforms over the DeviceMesh: FSDP, TP, CP, PP, EP, activation checkpointing, init."""
