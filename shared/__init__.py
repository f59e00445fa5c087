"""What every pagedserve service shares: settings, sampling parameters, the bus protocol and key names."""
