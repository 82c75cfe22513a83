"""One pipelined loop per executor: the client, discovery of executors, placement, and what a
completed Step records."""
