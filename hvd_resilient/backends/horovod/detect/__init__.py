"""How a Horovod worker learns of a failure before the Gloo timeout: a hang-up watch on the
Gloo connections (peer_watch, over tcp_sockets) and a watch on the driver (driver_watch)."""
