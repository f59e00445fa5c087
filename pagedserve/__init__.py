"""pagedserve's composition root: the `pagedserve` command, the local launcher and the in-process engine."""
