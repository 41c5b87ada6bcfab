"""The Ray local core: a site whose tasks run on an existing Ray cluster, through placement
groups (reservations) and the Ray Jobs API, and whose elastic nodes Ray's autoscaler starts."""
