from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('inventory', '0004_node_purge_fleet_samples'),
    ]

    operations = [
        migrations.AddField(
            model_name='node',
            name='address',
            field=models.GenericIPAddressField(blank=True, help_text="where the node's peers reach it (DILOCO_NODE_ADDRESS, else its address towards the broker): the rendezvous of a learner island whose rank 0 runs here", null=True),
        ),
    ]
