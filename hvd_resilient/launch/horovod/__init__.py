"""Launching Horovod: the horovodrun command line (command), Horovod's launcher taught slot
hosts, standby workers, a fatal stop and more (driver, run as ``python -m
hvd_resilient.launch.horovod.driver``; its switches in options, one module per patch family in
patches/), and the standby worker itself (standby)."""
