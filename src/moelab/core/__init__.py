"""The MoE layer's seams: router → RoutingPlan → dispatcher → experts → combine, plus losses."""
