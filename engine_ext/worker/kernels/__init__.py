"""The Triton kernels of the data plane, one module per feature; imported only for CUDA
tensors (and by tests, under Triton's CPU interpreter).

- :mod:`.steer`: ``dynsteer::steer``, the site kernel (capture, monitor, gate, both tiers,
  projection slots, the finite guard);
- :mod:`.steer_norm`: ``dynsteer::steer_norm``, a site and the add + RMSNorm after it;
- :mod:`.control_fold`: the built-in controllers' fold after each forward;
- :mod:`.gate_stats`: the per-request gate statistics' step;
- :mod:`.index_fill`: the per-token index filled from per-slot values;
- :mod:`._tl`: what they share (the layout as ``tl.constexpr``, jitted helpers).
"""
