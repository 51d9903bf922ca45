"""mpitrain: data-parallel training of softmax/MLP classifiers over MPI.

Rank 0 is the parameter server; ranks 1..N-1 are workers (NumPy or CuPy).
"""

__version__ = "0.1.0"
