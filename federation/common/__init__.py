"""What the coordinator and the site agents share, beneath both: job states, task keys, the
limits a site's view is held to, and the link probe. Neither side imports the other."""
