import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import ARCHS, make_checkpoint  # noqa: E402


@pytest.fixture(scope="session", params=ARCHS)
def tiny_model(request, tmp_path_factory) -> tuple[str, Path]:
    arch = request.param
    return arch, make_checkpoint(tmp_path_factory.mktemp(arch), arch)


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("mixtral_sharded"), "mixtral", shard_size="100KB")
