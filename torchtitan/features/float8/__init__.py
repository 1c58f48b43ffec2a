"""Float8 training with torchao: conversion, checks and the FSDP scale precompute."""
