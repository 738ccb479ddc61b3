"""Jobs that outlive a request (video jobs, async image jobs): their runs, their results and their webhooks."""
