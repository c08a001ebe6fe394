import os
import platform
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# the triton attention backend's kernels run on CPU tensors through Triton's interpreter, which
# triton fixes when it is imported (transformers may import it): set before anything imports it
import torch  # noqa: E402  (torch does not import triton)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tiny_models import (  # noqa: E402
    ARCHS,
    make_checkpoint,
    make_deepseek_checkpoint,
    make_gpt_oss_checkpoint,
    make_tool_checkpoint,
)


def _missing_kernels() -> str | None:
    """With AFDSERVE_REQUIRE_KERNELS=1 (CI): why the C++ kernels are not loaded although this CPU
    supports them (x86-64 with AVX-512F, or AVX2 + FMA + F16C) and nobody switched them off
    (AFDSERVE_KERNELS=0); None when that is fine. Without it a failed build only turns the kernel
    tests into skips."""
    if os.environ.get("AFDSERVE_REQUIRE_KERNELS") != "1" or os.environ.get("AFDSERVE_KERNELS") == "0":
        return None
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((line for line in f if line.startswith("flags")), ":").split(":", 1)[1].split())
    except OSError:
        return None
    if "avx512f" not in flags and not {"avx2", "fma", "f16c"} <= flags:
        return None
    from afdserve.backends.cpu.build import load  # the tests' one import of where the kernels are built

    state = load()
    return None if state.ok else state.reason


def pytest_sessionstart(session: pytest.Session) -> None:
    why = _missing_kernels()
    if why is not None:
        pytest.exit(f"AFDSERVE_REQUIRE_KERNELS=1: this CPU supports the C++ kernels, but they are not "
                    f"loaded ({why}); the kernel tests would only be skipped", returncode=pytest.ExitCode.TESTS_FAILED)


@pytest.fixture(scope="session", params=ARCHS)
def tiny_model(request, tmp_path_factory) -> tuple[str, Path]:
    arch = request.param
    return arch, make_checkpoint(tmp_path_factory.mktemp(arch), arch)


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("mixtral_sharded"), "mixtral", shard_size="100KB")


@pytest.fixture(scope="session")
def tiny_tool_model(tmp_path_factory) -> Path:
    """A tiny Mixtral whose chat template declares tools (tiny_models.TOOL_TEMPLATE)."""
    return make_tool_checkpoint(tmp_path_factory.mktemp("mixtral_tools"))


LONG_POSITIONS = 16384 + 64  # a 16k-token prompt and a few tokens after it


@pytest.fixture(scope="session")
def long_archs(tmp_path_factory) -> dict[str, Path]:
    """``four_archs`` whose context holds a 16k-token prompt (``LONG_POSITIONS``): context parallelism's."""
    root, n = tmp_path_factory.mktemp("long_archs"), LONG_POSITIONS
    return {"mixtral": make_checkpoint(root / "mixtral", "mixtral", max_position_embeddings=n),
            "qwen3_moe": make_checkpoint(root / "qwen3", "qwen3_moe", max_position_embeddings=n),
            "deepseek_v3": make_deepseek_checkpoint(root / "ds3", 3, max_position_embeddings=n),
            "gpt_oss": make_gpt_oss_checkpoint(root / "gpt_oss", max_position_embeddings=n)}


@pytest.fixture(scope="session")
def four_archs(tmp_path_factory) -> dict[str, Path]:
    """Tiny checkpoints of Mixtral, Qwen3-MoE, DeepSeek-V3 (MLA) and gpt-oss (sinks, windows), by name."""
    root = tmp_path_factory.mktemp("four_archs")
    return {"mixtral": make_checkpoint(root / "mixtral", "mixtral"),
            "qwen3_moe": make_checkpoint(root / "qwen3", "qwen3_moe"),
            "deepseek_v3": make_deepseek_checkpoint(root / "ds3", 3),
            "gpt_oss": make_gpt_oss_checkpoint(root / "gpt_oss")}
