"""hpclb: large-batch distributed training (LEGW, sqrt LR scaling, LARS/LAMB) over MPI.

Implements You et al., *Large-Batch Training for LSTM and Beyond*, SC '19.
"""
__version__ = "0.1.0"
