"""The parts of the stack on one machine (`tailserve up`), which `tailserve.assembly.stack`
assembles and supervises: worker processes (`processes`), the restart policy (`restarts`, pure),
the HAProxy front door's process (`haproxy`) and the admin lane (`admin`)."""
