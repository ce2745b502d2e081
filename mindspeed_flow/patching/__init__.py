"""The patch registry: declare, apply with wrapt, report and undo monkey patches."""
