"""The CPU kernels' sources compile for x86 CPUs other than this one: the library is built with
-march=native on the user's machine, so a path this machine never compiles (AVX-512 without BF16, AMX, plain
C) would otherwise first fail there, leaving every layer to PyTorch."""

import platform
import subprocess

import pytest

from llmserve_kernels.cpu import _build

# x86 generations with different vector extensions: AVX2 only; AVX-512 without VNNI; with VNNI but without
# BF16 (Ice Lake, as Cascade Lake); with BF16 and AMX; and nothing beyond SSE2.
TARGETS = ["haswell", "skylake-avx512", "icelake-server", "sapphirerapids", "x86-64"]


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the targets are x86 CPUs")
@pytest.mark.skipif(_build._compiler() is None, reason="no C compiler")
@pytest.mark.parametrize("march", TARGETS)
def test_sources_compile_for(march):
    flags = [f for f in _build._FLAGS if f not in ("-march=native", "-shared", "-O3")]
    # -O0: always_inline intrinsics are inlined (and checked against the target) at every level.
    compiles = {
        source.name: subprocess.Popen(
            [_build._compiler(), "-O0", f"-march={march}", *flags, "-c", str(source), "-o", "/dev/null"],
            stderr=subprocess.PIPE,
            text=True,
        )
        for source in sorted(_build.CSRC.glob("*.c"))
    }
    errors = {name: run.communicate()[1] for name, run in compiles.items()}
    if any("bad value" in stderr for stderr in errors.values()):
        pytest.skip(f"this compiler does not know -march={march}")
    failed = {name: errors[name] for name, run in compiles.items() if run.returncode != 0}
    assert not failed, failed
