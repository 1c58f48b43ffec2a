"""CUDA graphs of the compiled dense blocks (training.cuda_graphs): its pre-launch checks.

distributed/parallelize.py ``apply_compile`` compiles the blocks in that mode.
"""
