"""Command lines for the launchers (horovodrun, mpirun, torchrun) and the restart supervisor."""
