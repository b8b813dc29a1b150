"""Tests that start no process of their own: pure functions, parsers, in-process stores."""
