"""The engine's own GPU kernels, in Triton (which torch's CUDA wheels ship); each module holds one
kernel family with its host-side packing and launch, and runs under Triton's interpreter
(``TRITON_INTERPRET=1``) on a CPU for its tests."""
