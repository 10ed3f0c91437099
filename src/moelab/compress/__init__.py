"""Model compression: pruning, quantization, low-rank compensation and the lossless codec."""
