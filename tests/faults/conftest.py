"""What several fault modules start a Triton on: the tiny model's repository, one thread a model."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny_repository(artifact_dir, tmp_path_factory):
    from serving.triton.config import ServingSettings
    from serving.triton.repository import write_repository

    return write_repository(artifact_dir("tiny"), tmp_path_factory.mktemp("repository"), ServingSettings(threads=1))
