"""Launching Horovod: the horovodrun command lines (command), Horovod's launcher taught slot
hosts, standby workers, a fatal stop and more (driver, run as ``python -m
hvd_resilient.launch.horovod.driver``; its switches in options, one module per patch family in
patches/). The standby worker and the warm pool are in `launch/warm/`; what `hvd-resilient run
--launcher horovod` takes and checks, in `launch/launchers/horovod.py`."""
