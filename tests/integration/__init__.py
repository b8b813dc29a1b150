"""Tests against real parts: launchers (horovodrun, mpirun, torchrun), SeaweedFS, HTTP API
stand-ins, and our own scripts and CLIs run as subprocesses."""
