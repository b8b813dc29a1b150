"""Launching Horovod: the horovodrun command line (command), Horovod's launcher taught slot
hosts, standby workers and a fatal stop (driver, run as ``python -m
hvd_resilient.launch.horovod.driver``), and the standby worker itself (standby)."""
