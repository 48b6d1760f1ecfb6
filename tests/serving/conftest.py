import pytest

from tests.serving.helpers import PROTOCOLS, Client


@pytest.fixture(scope="module")
def clients(triton):
    """A tritonclient-backed test client per protocol for the shared Triton."""
    made = {protocol: Client(triton, protocol) for protocol in PROTOCOLS}
    yield made
    for client in made.values():
        client.close()
