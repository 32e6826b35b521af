"""Packing and fused quantise/dequantise kernels: a torch reference (any device) plus fast backends."""
