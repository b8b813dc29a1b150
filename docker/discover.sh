#!/bin/sh
# horovodrun's --host-discovery-script in the compose setup. `entrypoint.sh setup` copies it to
# /shared/discover.sh, where operators may change it while a job runs (horovodrun runs it
# every second). The hostfile names the workers; health-filter drops those whose sshd does not
# answer (stopped, killed, disconnected), so they leave the job within a second and return
# when they answer again. horovodrun passes its environment on, SSH_PORT included.
app="${APP_DIR:-/opt/hvd_resilient}"
exec "$app/discovery/health-filter" --port "${SSH_PORT:-2222}" -- \
    "$app/discovery/hostfile" "${HVD_RESILIENT_HOSTFILE:-/shared/hosts}"
