#!/bin/sh
# Leasehold logic as a script: Leasehold runs it once per trigger, under the record's lease.
#
#   LEASEHOLD_LOGIC_COMMAND=logic/run.sh            (packed with scripts/package.sh --logic examples/logic-script)
#
# It gets LEASEHOLD_SCOPE, LEASEHOLD_RECORD_ID, LEASEHOLD_FENCING_TOKEN, LEASEHOLD_ATTEMPT and
# LEASEHOLD_APP_ROOT, a base environment (PATH, HOME, locale, TZ, TMPDIR, certificates) and the
# variables LEASEHOLD_LOGIC_ENV names: nothing else of the worker's (its keys stay with it).
# Exit 0: done. Anything else: the trigger is retried, then given up to the poison queue with
# the last lines this script wrote to stderr as the reason. On SIGTERM, stop: the lease was lost
# or the worker is shutting down; what you started is stopped with you.
#
# The Functions images for the `custom` stack are Debian-based and have /bin/sh and coreutils,
# but no language runtime can be assumed: keep scripts to POSIX sh and the tools you pack.
set -eu

: "${LEASEHOLD_RECORD_ID:?run me through leasehold}"
echo "working on $LEASEHOLD_SCOPE/$LEASEHOLD_RECORD_ID (fencing token $LEASEHOLD_FENCING_TOKEN, attempt $LEASEHOLD_ATTEMPT)" >&2

# Your work goes here: read the record from the CRM, compute, write back, passing
# $LEASEHOLD_FENCING_TOKEN with every write so a store that checks it refuses a stale holder.

# For the example's test (LEASEHOLD_LOGIC_ENV=EXAMPLE_OUTPUT lets the variable through).
if [ -n "${EXAMPLE_OUTPUT:-}" ]; then
  printf 'script %s %s %s %s\n' "$LEASEHOLD_SCOPE" "$LEASEHOLD_RECORD_ID" "$LEASEHOLD_FENCING_TOKEN" "$LEASEHOLD_ATTEMPT" >>"$EXAMPLE_OUTPUT"
fi
