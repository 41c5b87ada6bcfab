"""Several coordinators: leader election, terms, fencing and backups."""
