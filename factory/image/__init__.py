"""Images: flavors and their locks, the wheelhouse, build contexts and references, Docker builds."""
