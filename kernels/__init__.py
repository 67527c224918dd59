"""Every kernel the engine runs, beside its plain PyTorch reference (`reference.py`).

`kernels.triton` holds the Triton kernels (CUDA; on the CPU they run under Triton's interpreter,
``TRITON_INTERPRET=1`` set before Python starts, which is how the tests check them); `kernels.cpu` the
native CPU kernels and their loader. This package imports only torch, triton and ctypes, never engine
code; its subpackages load on demand, so using one never imports the other.
"""
