#!/bin/sh
# CI hook: tell a pod how a pipeline step went, e.g. as the last step of a job:
#
#     examples/ci_notify.sh reviewer "build $CI_PIPELINE_ID failed: $CI_JOB_URL"
#
# The notification is durable once this exits 0 (the pod fsyncs it before it answers) and
# reaches the model at its next request; an idle pod wakes up for it. Prints the notification id.
# Exit 3 if the pod is not running; 1 if it does not answer within 30 s (stopped, wedged: it
# may still take the message when it runs again). PODCTL overrides the podctl to use.
#
# Without podctl, any shell with socat can do the same over the pod's socket
# (<runtime>/pods/POD/sock; runtime = $PODDAEMON_RUNTIME_DIR, else $PODDAEMON_HOME/run, else
# $XDG_RUNTIME_DIR/poddaemon); the message must be JSON-escaped:
#   printf '%s\n' '{"jsonrpc":"2.0","id":1,"method":"notify","params":{"message":"build failed","source":"ci"}}' \
#     | socat - UNIX-CONNECT:"$XDG_RUNTIME_DIR/poddaemon/pods/reviewer/sock"
set -eu

if [ "$#" -ne 2 ]; then
    echo "usage: $0 POD MESSAGE   (MESSAGE '-' reads it from stdin)" >&2
    exit 2  # a usage error, as podctl's
fi

exec "${PODCTL:-podctl}" notify "$1" "$2" --source ci
