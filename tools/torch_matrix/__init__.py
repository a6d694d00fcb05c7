"""Plan cases and engine tests on other torch releases, each in a venv of its own (``make test-torch``)."""
