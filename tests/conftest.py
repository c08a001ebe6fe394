import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import ARCHS, make_checkpoint, make_tool_checkpoint  # noqa: E402


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
