"""Operations of the pool: drain, sweep, retention, the scrape, the pool's view, heartbeats
and the footage fan-out."""
