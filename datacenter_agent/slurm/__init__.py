"""The Slurm local core: a site whose nodes Slurm schedules. Offers become held Slurm jobs
(reservations), commits release them to run, and the site's view is read from Slurm."""
