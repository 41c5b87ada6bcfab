"""Sites: their registry and live views, the site link, enrollment, lost sites,
drains and capacity."""
