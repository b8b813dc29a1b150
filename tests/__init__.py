"""The test suite, laid out like the code: unit/, integration/, chaos/, and support/ for what
they share (see tests/README.md)."""
