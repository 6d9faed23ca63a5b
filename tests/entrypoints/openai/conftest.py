from __future__ import annotations

import pytest

from tests.entrypoints.openai.helpers import ThreadedServer, make_app, make_engine, openai_client, write_char_tokenizer
from tests.entrypoints.openai.subprocess_server import served_model

API_KEY = "test-key"


@pytest.fixture(scope="session")
def char_tokenizer_dir(tmp_path_factory):
    return write_char_tokenizer(tmp_path_factory.mktemp("char-tokenizer"))


@pytest.fixture(scope="module")
def mock_server(char_tokenizer_dir):
    """A real uvicorn (in a thread) serving a mock engine: 2 ms per step, poison token '~' (id 95)."""
    engine = make_engine(char_tokenizer_dir, delay_s=0.002, poison_token=95)
    app, async_engine = make_app(engine, api_key=API_KEY, max_request_bytes=64 * 1024)
    with ThreadedServer(app) as server:
        server.engine = engine
        server.async_engine = async_engine
        yield server


@pytest.fixture()
def client(mock_server):
    return openai_client(mock_server, API_KEY)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The checkpoint the subprocess server tests serve: the bundled model, else a tiny random Mixtral with
    the character tokenizer (built once per module)."""
    return served_model(tmp_path_factory)
