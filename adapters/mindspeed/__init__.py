"""MindSpeed: mindspeed-flow as one feature of MindSpeed's feature manager."""
